"""Test support for omniwire and for third-party backends: strategies and conformance."""
