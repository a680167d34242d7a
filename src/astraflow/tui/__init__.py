"""The Textual dashboard (`astraflow dash`); only the CLI's dash command imports this package."""
