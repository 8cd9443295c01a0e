"""The fake provider moved to :mod:`runledger.testing.provider`; this name keeps old imports
(``from runledger.demo.provider import ProviderClient``) and ``python -m
runledger.demo.provider`` working.
"""

from __future__ import annotations

from runledger.testing.provider import (
    FakeProvider,
    ProviderClient,
    ProviderError,
    main,
    make_server,
)

__all__ = ["FakeProvider", "ProviderClient", "ProviderError", "main", "make_server"]

if __name__ == "__main__":
    main()
