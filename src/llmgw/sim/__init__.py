"""Simulated engine, node hardware and fabric, for tests and the demo."""
