"""Tiers beyond one local store.

The replica and its upload protocol (whole steps, per-rank uploads, the upload gate),
node-local roots with their two-phase commit, and fills from the replica.
"""
