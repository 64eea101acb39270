"""The trainer Space: a training loop that publishes every optimizer step as an exact delta."""
