"""Command-line tools, each one step on top of data/, models/ and training/: launch, doctor, extract, encode,
export, report; cli.py and trained_codec.py hold what several of them share."""
