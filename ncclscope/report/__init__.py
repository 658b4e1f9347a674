"""Plotly HTML report: presents what the analyses return."""
