"""rankscope.report: placeholder (filled in below)."""
