"""Adapters that turn agents of other frameworks, or bare model SDKs, into runledger Flows.

Each adapter lives in its own module and imports its framework only there, so that
``runledger`` imports without any extra installed. Adapters build :class:`~runledger.Flow`
objects (or policies); like tool code, they never touch the database.
"""
