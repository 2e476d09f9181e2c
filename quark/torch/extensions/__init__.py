"""Extensions of the engine: the Brevitas-style configuration of the reference docs."""
