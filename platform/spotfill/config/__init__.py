"""Validated configuration: job and prepare configs, errors, environment constants."""
from spotfill.config.job import (ClusterConfig, DataConfig, JobConfig, PrepareConfig,  # noqa: F401
                                 TrainingConfig, from_mapping, load_job_config, load_prepare_config, load_yaml)
