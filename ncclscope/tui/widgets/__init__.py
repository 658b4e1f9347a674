"""Reusable widgets and text plots of the ncclscope TUI."""
