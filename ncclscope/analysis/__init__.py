"""One module per question the analyzer answers; each returns Findings and tables."""
