"""A small inventory service: stock levels per warehouse, reservations and reorder points."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections import defaultdict


@dataclasses.dataclass
class Item:
    sku: str
    name: str
    unit_price: float
    reorder_point: int = 10
    reorder_quantity: int = 50


@dataclasses.dataclass
class Reservation:
    sku: str
    warehouse: str
    quantity: int
    expires: dt.datetime


class OutOfStock(Exception):
    """Raised when a reservation asks for more than is available."""


class Inventory:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}
        self.stock: dict[tuple[str, str], int] = defaultdict(int)
        self.reservations: list[Reservation] = []

    def add_item(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item

    def receive(self, sku: str, warehouse: str, quantity: int) -> None:
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        self.stock[(sku, warehouse)] += quantity

    def reserved(self, sku: str, warehouse: str, now: dt.datetime) -> int:
        return sum(r.quantity for r in self.reservations
                   if r.sku == sku and r.warehouse == warehouse and r.expires > now)

    def available(self, sku: str, warehouse: str, now: dt.datetime) -> int:
        return self.stock[(sku, warehouse)] - self.reserved(sku, warehouse, now)

    def reserve(self, sku: str, warehouse: str, quantity: int, now: dt.datetime,
                minutes: int = 30) -> Reservation:
        if self.available(sku, warehouse, now) < quantity:
            raise OutOfStock(f"{sku} in {warehouse}: {quantity} asked")
        reservation = Reservation(sku, warehouse, quantity, now + dt.timedelta(minutes=minutes))
        self.reservations.append(reservation)
        return reservation

    def ship(self, reservation: Reservation, now: dt.datetime) -> None:
        if reservation.expires <= now:
            raise ValueError("the reservation expired")
        self.reservations.remove(reservation)
        self.stock[(reservation.sku, reservation.warehouse)] -= reservation.quantity

    def expire(self, now: dt.datetime) -> int:
        before = len(self.reservations)
        self.reservations = [r for r in self.reservations if r.expires > now]
        return before - len(self.reservations)

    def total_stock(self, sku: str) -> int:
        return sum(quantity for (item, _), quantity in self.stock.items() if item == sku)

    def stock_value(self, warehouse: str) -> float:
        return sum(self.items[sku].unit_price * quantity
                   for (sku, place), quantity in self.stock.items() if place == warehouse)
