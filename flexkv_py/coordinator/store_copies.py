"""A store's GPU->host copies: the one copy of an ordinary store, or one per round of a store
streamed through fewer host slots than blocks (coordinator/stores.py). Each ends the job's GPU
read (gpu_reads.py) as early as it can: vLLM may reuse the blocks from then on."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from flexkv_py.coordinator.counters import Counters
from flexkv_py.coordinator.gpu_reads import Abandoned, GpuReads
from flexkv_py.coordinator.jobs import StoreJob
from flexkv_py.transfer.stream_order import OrderedTransfer, StreamMark, TransferHandleLike

logger = logging.getLogger(__name__)

# A store's GPU->host copy as handed from submit to the job thread: issued (its handle), to be
# issued after a spill or a round before (the caller's stream mark), or None (host-only store).
D2h = TransferHandleLike | StreamMark | None


class StoreCopies:
    def __init__(self, transfer: OrderedTransfer, reads: GpuReads, stats: Counters) -> None:
        self.transfer = transfer
        self.reads = reads
        self.stats = stats

    def round(self, job: StoreJob, mark: StreamMark, part: Sequence[int], last: bool) -> bool:
        """One round's GPU->host copy, behind the caller's stream mark; True if it arrived and
        the job was not abandoned. The last round's copy is the job's GPU read: its end is
        reported (gpu_reads.py) as soon as it is done, as is a failed round's."""
        assert job.gpu_block_ids is not None
        ids = job.gpu_block_ids
        ok = False
        try:
            if self.reads.is_abandoned(job.job_id):
                raise Abandoned  # the GPU blocks may hold other KV now: do not copy
            if part:
                slots = [job.host_slots[i] for i in part]
                copy = self.transfer.submit("d2h", [ids[i] for i in part], slots, after=mark)
                if last:
                    self.reads.issued(job.job_id, copy)
                copy.wait()
            # Abandoned while the copy ran: it may have read blocks vLLM reused.
            if self.reads.end(job.job_id) if last else self.reads.is_abandoned(job.job_id):
                raise Abandoned
            self.stats.add("d2h_blocks", len(part))
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
        """The store's GPU->host copy (issued at submit, or now behind the caller's stream
        mark); True if every block arrived and the caller did not abandon the job."""
        try:
            if d2h_error is not None:
                raise d2h_error
            if isinstance(d2h, StreamMark):
                assert job.gpu_block_ids is not None
                if self.reads.is_abandoned(job.job_id):
                    raise Abandoned  # the GPU blocks may hold other KV now: do not copy
                d2h = self.transfer.submit("d2h", job.gpu_block_ids, job.host_slots, after=d2h)
                self.reads.issued(job.job_id, d2h)
            assert d2h is not None
            d2h.wait()
            if self.reads.end(job.job_id):
                raise Abandoned
            self.stats.add("d2h_blocks", len(job.keys))
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
