"""Reinforcement-learning phases: the weights switch between a training and a rollout layout."""
