"""The studies floor: studies that drive the replay and the simulator and write their own result folders.

* :mod:`kvlab.studies.tiers`: issue 12's tiered-storage study (notebook 04, part 1);
* :mod:`kvlab.studies.serving_tiers`: issue 14's TTFT-with-timed-tiers study (notebook 04, part 2;
  ``python -m kvlab.studies.serving_tiers``);
* :mod:`kvlab.studies.hashing`: block size and hashing studies (notebook 06).

The layout study is :mod:`kvlab.layout`, on the same floor. Nothing below this floor imports it
(benchmarks/import_graph.py); import the study module itself (this package re-exports nothing, so importing one
study does not load the others' drivers).
"""
