"""Ready tools for real providers, each with the lookup that settles a call found in
flight after a crash (docs/providers.md).

Every adapter sends the call's idempotency key the way its provider takes it (a header,
metadata, a hidden marker) and looks it up the same way. Each knows how long its
provider keeps what the lookup reads: past that window a lookup that finds nothing
raises :class:`runledger.Unknowable` (the call waits for a person), never a resend.

The shared pieces are in :mod:`runledger.providers.base`; the adapters are imported by
name (``runledger.providers.http``, ``.stripe``, ``.github``, ``.slack``, ``.email``),
so that each needs only its own SDK.
"""
