"""Command-line tools, each one step on top of data/, models/ and training/: launch, doctor, extract, encode,
export, report, flags_doc (docs/flags.md from the code); cli.py, trained_codec.py and launch_rules.py hold what
several of them share."""
