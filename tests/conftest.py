pytest_plugins = ["service.testing"]
