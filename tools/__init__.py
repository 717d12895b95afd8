"""Command-line tools: each runs one step (launch, doctor, extract, encode, export, report) on top of data/, models/ and training/."""
