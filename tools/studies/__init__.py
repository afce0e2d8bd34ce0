"""The studies behind the paper's figures: the federated experiment on the synthetic
device types with its report, and the synthetic study of the aggregation rules."""
