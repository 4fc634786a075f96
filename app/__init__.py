"""The kvchat service and its command line."""
