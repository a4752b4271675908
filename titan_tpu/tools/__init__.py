"""Tools over the whole stack (verify, report): they may import every other layer; nothing imports them."""
