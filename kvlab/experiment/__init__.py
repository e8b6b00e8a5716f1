"""Experiments: one YAML file (or :class:`Experiment`) per study, run with ``kvlab run`` (docs/experiments.md)."""

from kvlab.experiment.backends import run_experiment
from kvlab.experiment.config import Experiment, Sweep, expand, load_experiment
from kvlab.experiment.runner import experiment_folder, load, plan
from kvlab.experiment.sections import CacheSpec, HasherSpec, TraceSpec

__all__ = ["CacheSpec", "Experiment", "HasherSpec", "Sweep", "TraceSpec", "expand", "experiment_folder", "load",
           "load_experiment", "plan", "run_experiment"]
