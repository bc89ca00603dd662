"""A store's GPU->host leg: the one copy of an ordinary store, or one per round of a store
streamed through fewer host slots than blocks (coordinator/stores.py), each through the
handler registered for GPU -> host (copy_handlers.py). Each ends the job's GPU read
(gpu_reads.py) as early as it can: vLLM may reuse the blocks from then on."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from flexkv_py.coordinator.counters import Counters
from flexkv_py.coordinator.gpu_reads import Abandoned, GpuReads
from flexkv_py.coordinator.jobs import StoreJob
from flexkv_py.coordinator.leg_handlers import Flow, Handlers
from flexkv_py.coordinator.legs import Leg
from flexkv_py.errors import FlexKVError
from flexkv_py.transfer.stream_order import StreamMark

logger = logging.getLogger(__name__)

# A store's GPU->host copy as handed from submit to the job thread: opened with every block fed
# (its flow), to be opened after a spill or a round before (the caller's stream mark), or None
# (a host-only store).
D2h = Flow | StreamMark | None


class CopyFailed(FlexKVError):
    """A store's GPU->host copy did not bring every block (raised and caught in this module)."""


def gpu_to_host(job: StoreJob) -> Leg:
    """The store's GPU -> host leg: each block from its GPU block into its host slot."""
    assert job.gpu is not None
    return Leg(job.blocks, job.gpu, job.host)


class StoreCopies:
    def __init__(self, handlers: Handlers, reads: GpuReads, stats: Counters) -> None:
        self.handlers = handlers
        self.reads = reads
        self.stats = stats

    def start(self, job: StoreJob) -> Flow:
        """Open the store's GPU -> host leg with every block fed, in the caller's thread (its
        copy is ordered after the caller's stream), and watch it as the job's GPU read."""
        flow = self.handlers.open(gpu_to_host(job))
        flow.feed_all()
        self.reads.issued(job.job_id, flow)
        return flow

    def round(self, job: StoreJob, mark: StreamMark, part: Sequence[int], last: bool) -> bool:
        """One round's GPU->host copy, behind the caller's stream mark; True if it arrived and
        the job was not abandoned. The last round's copy is the job's GPU read: its end is
        reported (gpu_reads.py) as soon as it is done, as is a failed round's."""
        ok = False
        try:
            if self.reads.is_abandoned(job.job_id):
                raise Abandoned  # the GPU blocks may hold other KV now: do not copy
            if part:
                flow = self.handlers.open(gpu_to_host(job), after=mark)
                flow.feed(part)
                if last:
                    self.reads.issued(job.job_id, flow)
                if flow.finish().failed:
                    raise CopyFailed(f"{len(part)} blocks")
            # Abandoned while the copy ran: it may have read blocks vLLM reused.
            if self.reads.end(job.job_id) if last else self.reads.is_abandoned(job.job_id):
                raise Abandoned
            ok = True
        except Abandoned:
            logger.warning(
                "store job %d: abandoned before its GPU->host copies finished; a round of %d "
                "blocks and the later rounds fail (their GPU blocks may have been reused)",
                job.job_id,
                len(part),
            )
            self.stats.add("abandoned_store_blocks", len(part))
        except Exception as e:
            logger.warning("store job %d: GPU->host copy failed: %s", job.job_id, e)
        finally:
            if last or not ok:
                self.reads.end(job.job_id)  # the GPU blocks are free to reuse from here
        return ok

    def all_at_once(self, job: StoreJob, d2h: D2h, d2h_error: BaseException | None) -> bool:
        """The store's GPU->host copy (started at submit, or now behind the caller's stream
        mark); True if every block arrived and the caller did not abandon the job."""
        try:
            if d2h_error is not None:
                raise d2h_error
            if isinstance(d2h, StreamMark):
                if self.reads.is_abandoned(job.job_id):
                    raise Abandoned  # the GPU blocks may hold other KV now: do not copy
                d2h = self.handlers.open(gpu_to_host(job), after=d2h)
                d2h.feed_all()
                self.reads.issued(job.job_id, d2h)
            assert d2h is not None
            if d2h.finish().failed:
                raise CopyFailed(f"{len(job.keys)} blocks")  # (its GPU read ends below)
            if self.reads.end(job.job_id):
                raise Abandoned
            return True
        except Abandoned:
            logger.warning(
                "store job %d: abandoned before its GPU->host copy finished; its %d blocks "
                "fail (their GPU blocks may have been reused)",
                job.job_id,
                len(job.keys),
            )
            self.stats.add("abandoned_store_blocks", len(job.keys))
        except Exception as e:
            logger.warning("store job %d: GPU->host copy failed: %s", job.job_id, e)
        finally:
            self.reads.end(job.job_id)  # the GPU blocks are free to reuse from here
        return False
