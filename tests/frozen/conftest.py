"""The frozen peers under this folder run in a pytest of their own, rooted at each
kit (tests/test_frozen_peers.py): the suite itself collects none of their files."""

collect_ignore_glob = ["*"]
