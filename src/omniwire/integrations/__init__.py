"""Adapters that put omniwire under the frameworks users already run.

Each one is an optional extra, turned on with one documented call, checks the
framework's version and every internal name it relies on (a clear error when one
changed), and never forks the framework. See ``docs/`` for each.
"""
