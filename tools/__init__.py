"""Command-line tools, each one step on top of rvq_tokenizer's library (a trained codec over audio), training/,
data/ and models/: launch, doctor, check, extract, tokenize, encode, evaluate, export, report, flags_doc
(docs/flags.md from the code); cli.py, codes_flags.py, audio_shard.py and launch_rules.py hold what several of
them share. Each sets what is process-wide (threads, BLAS) in its own entry point."""
