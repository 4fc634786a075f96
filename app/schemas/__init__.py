"""Request and response models of the API (OpenAI's shapes where one exists), apart from the
database tables."""
