"""Plotly HTML report: presents what the analyses return.

    from ncclscope.report import write_report
    stats = write_report(trace, "report.html")     # diagnosis and perf computed if not given
"""
from ncclscope.report.html import write_report

__all__ = ["write_report"]
