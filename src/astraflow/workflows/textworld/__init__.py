"""The text-game workload: TextWorld and ALFWorld games, each in a game-engine process (`textworld`)."""
