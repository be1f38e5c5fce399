"""The examples, end to end with tiny budgets."""
