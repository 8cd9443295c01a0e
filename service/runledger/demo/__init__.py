"""The demo flows and the fake provider."""
