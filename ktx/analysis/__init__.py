"""Analyses of trained ktx models (`ktx analyze ...`)."""
