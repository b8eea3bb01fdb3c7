from macrogen.markers import define

SIZE = define(8)
