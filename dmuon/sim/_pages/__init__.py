"""The simulator's HTML page and PNG plot."""
