"""``convoy bench``: measure the cluster and the strategies through Convoy's own launchers.

- ``allreduce``: in-place ``all_reduce`` bus bandwidth over a size sweep, shaped like
  nccl-tests' rows (``size count type redop time algbw busbw``);
- ``scaling``: the recipe's model at several world sizes, weak or strong, with the scaling
  efficiency ``E = X_N / (N x X_1)`` from global throughput;
- ``compare``: the strategies, and their ``+ac`` / ``+compile`` layouts, like for like (same
  seed, global batch and wrap units), with step time, throughput, peak memory per rank,
  compile time and a loss-agreement check.

Every benchmark runs on the workers a training run would get (``local``, ``torchrun``, ``ray``,
one node or several): the all-reduce one as a ``WorkerEntry``, the other two as ordinary
engine runs whose ``metrics.jsonl`` and ``summary.json`` they read back. Shared pieces live in
``common`` (sizes, statistics, tables, job loading) and ``plots`` (matplotlib, imported lazily).
"""
