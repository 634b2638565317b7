"""Billing's settings: gaas/settings/billing.py declares them (each variable, default and help,
once); BillingConfig is their name here."""

from gaas.settings.billing import BillingSettings as BillingConfig

__all__ = ["BillingConfig"]
