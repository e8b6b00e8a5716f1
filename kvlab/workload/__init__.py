"""Workloads: the columnar request stream, trace loaders, generators and token expansion."""

from kvlab.workload.workload import Workload, from_lists

__all__ = ["Workload", "from_lists"]
