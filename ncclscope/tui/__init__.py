"""Textual TUI for post-mortem of hung jobs and following live ones."""
