"""The Prefect flows, their tasks and deployments: what a data team deploys and runs. Import the flows
from here (`from frenzy_prefect.flows import train_llm`)."""

from frenzy_prefect.flows.datasets import prepare_dataset_flow, watch_datasets
from frenzy_prefect.flows.error_records import quiet_named_causes
from frenzy_prefect.flows.training import distributed_train, train_llm

quiet_named_causes()  # the engine imports the flows through this package: their runs' logs name causes in one line

__all__ = ["distributed_train", "prepare_dataset_flow", "train_llm", "watch_datasets"]
