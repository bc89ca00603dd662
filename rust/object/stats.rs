//! The object tier's counters: requests by kind, body bytes each way, outcomes per block.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::tier::{StatValue, StatsSnapshot};

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        #[derive(Default)]
        pub struct ObjectStats { $(pub $name: AtomicU64,)* }

        impl ObjectStats {
            pub fn snapshot(&self) -> StatsSnapshot {
                vec![$((stringify!($name), StatValue::Int(self.$name.load(Ordering::Relaxed))),)*]
            }
        }
    };
}

counters!(
    put_requests,
    put_body_bytes,
    puts_ok,
    puts_known,
    puts_exists,
    get_requests,
    get_body_bytes,
    gets_ok,
    gets_not_found,
    gets_corrupt,
    head_requests,
    delete_requests,
    list_requests,
    io_errors,
    timeouts,
    runtime_builds,
    chain_lookups,
    chain_confirm_heads,
    chain_claim_vouches,
    chain_confirm_cuts,
    manifest_puts,
    claims_won,
    claims_lost,
    claim_polls,
    puts_claimed,
    claim_waits_expired,
    gc_passes,
    gc_pass_failures,
);

pub fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}
