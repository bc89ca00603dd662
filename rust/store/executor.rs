//! A small fixed pool of threads that run batches (hash, compress, verify, wait on devices),
//! so a submit returns at once and the caller never blocks on the store.

use std::thread::JoinHandle;

use crossbeam_channel::Sender;

type Task = Box<dyn FnOnce() + Send>;

pub struct Executor {
    tx: Option<Sender<Task>>,
    threads: Vec<JoinHandle<()>>,
}

impl Executor {
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Task>();
        let threads = (0..threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new().name(format!("flexkv-batch-{i}")).spawn(move || {
                    while let Ok(task) = rx.recv() {
                        task();
                    }
                })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Executor { tx: Some(tx), threads })
    }

    /// Queue a task; gives it back if the pool has shut down.
    pub fn spawn(&self, task: Task) -> Result<(), Task> {
        match &self.tx {
            Some(tx) => tx.send(task).map_err(|e| e.into_inner()),
            None => Err(task),
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        self.tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
