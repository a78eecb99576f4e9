"""The alert rules, one module each: ``divergence`` (the statistical kinds, read from the CUSUMs),
``pair`` (at W = 2, which of the two ranks a split belongs to), ``replica``, ``nonfinite`` and
``duplicate_data`` (no baseline: from the step's own values). The watchdog's ``unsynchronised``
is ``ddphooks.watchdog``'s."""
