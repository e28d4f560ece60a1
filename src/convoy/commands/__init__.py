"""One module per ``convoy`` command: train, config, export, evaluate, list, data, k8s, bench,
plan, report, tune. Shared argument helpers live in :mod:`convoy.commands.common`; the table
``convoy train`` prints at the end in :mod:`convoy.commands.summary_lines`.

Each command module has ``add_parser(commands)``, which adds its sub-command to the
sub-parsers ``commands`` and sets ``handler`` (``args -> exit code``) on every leaf parser
with ``parser.set_defaults``. :mod:`convoy.cli` builds the parser from the list of command
modules and calls ``args.handler(args)``; it turns Convoy's errors into one line and an exit
code. A command module imports what it runs at its top, except the few modules whose import
would slow every ``convoy`` invocation by seconds (preflight and the built-in tasks, which load
torchmetrics; the exporter; ``plan --check``): those are imported inside the handler that needs
them, with a comment saying why. No module here imports ``convoy.cli``.
"""
