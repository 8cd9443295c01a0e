pytest_plugins = ["runledger.testing"]
