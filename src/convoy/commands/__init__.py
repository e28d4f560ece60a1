"""One module per ``convoy`` command: train, config, export, evaluate, list, data, k8s, bench,
plan, report, tune. Shared argument helpers live in :mod:`convoy.commands.common`; the table
``convoy train`` prints at the end in :mod:`convoy.commands.summary_lines`.

Each command module has ``add_parser(commands)``, which adds its sub-command to the
sub-parsers ``commands`` and sets ``handler`` (``args -> exit code``) on every leaf parser
with ``parser.set_defaults``. :mod:`convoy.cli` builds the parser from the list of command
modules and calls ``args.handler(args)``; it turns Convoy's errors into one line and an exit
code. The handlers import the features they run (Ray, Kubernetes, the benchmarks, the
exporter) inside their bodies, so that ``convoy --help`` and ``import convoy.cli`` stay fast
and need none of the optional extras.
"""
