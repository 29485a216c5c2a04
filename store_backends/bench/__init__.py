"""ucm-bench: throughput and latency of a store, next to the raw medium it sits on.

This package owns the ``ucm-bench`` console script.  It measures a store
only through the public ``KVStore`` interface, and in the same run measures
the plain medium underneath (memcpy, plain files, plain redis-py) with the
same block size, block count, batching and threads, so that the figure that
matters, store/raw, is not spoiled by a machine that was busier at another
time.  Every block read back is compared with what was written: a benchmark
that can report a fast store returning wrong bytes is worse than none.

The modules, one idea each:

* ``parsing``: the options and help text;
* ``buffers``: the values put and the buffers read into;
* ``phases``: the threads of one timed phase;
* ``raw``: the raw media (memcpy, files, redis-py);
* ``figures``: throughput, latency percentiles, store/raw ratios;
* ``verify``: every way the store disagreed with what was put;
* ``runner``: the rounds of a run, and its report (the ``--json`` document);
* ``output``: the table and messages printed;
* ``command``: ``main``, from the command line to the exit status.

It must not reach into a backend's internals; it knows a store only by its
URL and its interface, and uses only what ``store_backends`` exports (its
progress line is ``store_backends.Progress``, shared with ``ucm``).
"""

from .buffers import PAGE, aligned_empty, make_values
from .command import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, EXIT_VERIFY, main, url_scheme_or_none
from .figures import OpFigures
from .output import MAX_FAILURES_SHOWN, format_table
from .parsing import ALL_OPS, DEFAULT_OPS, build_parser
from .phases import Call, PhaseResult, run_phase
from .raw import FileRaw, MemcpyRaw, RawMedium, RedisRaw, open_raw
from .runner import PREFIX_LEN_CALLS_PER_ROUND, Bench, BenchConfig
from .verify import Verifier

__all__ = [
    "ALL_OPS", "DEFAULT_OPS", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "EXIT_VERIFY", "MAX_FAILURES_SHOWN",
    "PAGE", "PREFIX_LEN_CALLS_PER_ROUND",
    "Bench", "BenchConfig", "Call", "FileRaw", "MemcpyRaw", "OpFigures", "PhaseResult", "RawMedium", "RedisRaw",
    "Verifier",
    "aligned_empty", "build_parser", "format_table", "main", "make_values", "open_raw", "run_phase",
    "url_scheme_or_none",
]
