"""What clients connect to: the main port's listener and the routes the router answers itself."""
