"""Decoding workers: batches searched side by side in processes of one thread each
(``qkv.data.workers``, which ``qkv prepare``'s encoding workers use too).

On two cores, two processes of one thread each, every one searching whole batches (CTranslate2's
``inter_threads`` layout), decoded the preset's model greedily 1.13x to 1.18x faster than one
process of two threads and int8 beam 5 1.09x to 1.12x; at fp32 beam 5 the faster layout changed
from one benchmark run to the next (docs/benchmarks.md, (c)). One thread each also makes a worker's sums round exactly as those
of one process running one thread, so the translations do not depend on the layout. A batch travels
to a worker as lists of token ids and comes back as hypotheses.
"""

from __future__ import annotations

from qkv.data.workers import Workers as DecodingWorkers

__all__ = ["DecodingWorkers"]
