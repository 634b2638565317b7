"""Admission and metering: quotas and budgets checked in Redis before a request, one usage event after it."""
