"""pytest plugin entry point (registered as ``pytest11``); fixtures live here."""
