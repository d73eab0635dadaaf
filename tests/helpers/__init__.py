"""What several test modules share: fakes behind the project's public seams, starters, readers."""
