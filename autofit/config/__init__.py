"""What the user asks for, as frozen data without torch: model.yaml (`spec`), its reader,
and `TrainConfig`, one point of the search space."""
