//! Expression builders: the JSON of `nft -j` through the `nftables` crate's
//! types.

use std::{
    borrow::Cow,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use nftables::{
    expr::{self, Expression, NamedExpression, Payload, PayloadField, SetItem},
    stmt::{self, Operator, Statement},
};

pub(super) fn s(v: &str) -> Expression<'static> {
    Expression::String(Cow::Owned(v.to_string()))
}

pub(super) fn field(protocol: &'static str, name: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: protocol.into(),
            field: name.into(),
        },
    )))
}

pub(super) fn meta(key: expr::MetaKey) -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(expr::Meta { key }))
}

pub(super) fn ct(key: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::CT(expr::CT {
        key: key.into(),
        family: None,
        dir: None,
    }))
}

pub(super) fn concat(items: Vec<Expression<'static>>) -> Expression<'static> {
    Expression::Named(NamedExpression::Concat(items))
}

pub(super) fn anon_set(items: Vec<Expression<'static>>) -> Expression<'static> {
    Expression::Named(NamedExpression::Set(
        items.into_iter().map(SetItem::Element).collect(),
    ))
}

pub(super) fn range(lo: Expression<'static>, hi: Expression<'static>) -> Expression<'static> {
    Expression::Range(Box::new(expr::Range { range: [lo, hi] }))
}

pub(super) fn is(left: Expression<'static>, right: Expression<'static>) -> Statement<'static> {
    Statement::Match(stmt::Match {
        left,
        right,
        op: Operator::EQ,
    })
}

pub(super) fn is_in(left: Expression<'static>, right: Expression<'static>) -> Statement<'static> {
    Statement::Match(stmt::Match {
        left,
        right,
        op: Operator::IN,
    })
}

pub(super) fn set_ref(name: &str) -> Expression<'static> {
    s(&format!("@{name}"))
}

/// `key vmap { element : verdict, ... }`, an anonymous verdict map (a hash
/// lookup in a base chain, which every transaction writes again, so the
/// map needs no name to be updated by).
pub(super) fn vmap(key: Expression<'static>, items: Vec<SetItem<'static>>) -> Statement<'static> {
    Statement::VerdictMap(stmt::VerdictMap {
        key,
        data: Expression::Named(NamedExpression::Set(items)),
    })
}

pub(super) fn named_counter(name: &str) -> Statement<'static> {
    Statement::Counter(stmt::Counter::Named(Cow::Owned(name.to_string())))
}

/// The address field of family `v6`: `ip saddr` or `ip6 daddr`...
pub(super) fn addr(v6: bool, src: bool) -> Expression<'static> {
    field(
        if v6 { "ip6" } else { "ip" },
        if src { "saddr" } else { "daddr" },
    )
}

/// An address of family `v6` from its number.
pub(super) fn ip_of(v6: bool, n: u128) -> IpAddr {
    if v6 {
        IpAddr::V6(Ipv6Addr::from(n))
    } else {
        IpAddr::V4(Ipv4Addr::from(u32::try_from(n).unwrap_or(u32::MAX)))
    }
}

/// One element of an address set: an address, or an inclusive range.
pub(super) fn addr_element(v6: bool, lo: u128, hi: u128) -> Expression<'static> {
    if lo == hi {
        s(&ip_of(v6, lo).to_string())
    } else {
        range(s(&ip_of(v6, lo).to_string()), s(&ip_of(v6, hi).to_string()))
    }
}

/// A port, or an inclusive range of ports.
pub(super) fn port_element(lo: u16, hi: u16) -> Expression<'static> {
    if lo == hi {
        Expression::Number(u32::from(lo))
    } else {
        range(
            Expression::Number(u32::from(lo)),
            Expression::Number(u32::from(hi)),
        )
    }
}

pub(super) fn ct_state(states: &[&str]) -> Statement<'static> {
    is_in(
        ct("state"),
        Expression::List(states.iter().map(|st| s(st)).collect()),
    )
}

/// `tcp flags & (syn | ack) != syn`: a TCP packet that opens nothing.
pub(super) fn mid_stream_tcp() -> Statement<'static> {
    Statement::Match(stmt::Match {
        left: Expression::BinaryOperation(Box::new(expr::BinaryOperation::AND(
            field("tcp", "flags"),
            Expression::List(vec![s("syn"), s("ack")]),
        ))),
        right: s("syn"),
        op: Operator::NEQ,
    })
}

/// `ct status & dnat == 0`: no Service (or hostPort) in between.
pub(super) fn not_dnat() -> Statement<'static> {
    Statement::Match(stmt::Match {
        left: Expression::BinaryOperation(Box::new(expr::BinaryOperation::AND(
            ct("status"),
            s("dnat"),
        ))),
        right: Expression::Number(0),
        op: Operator::EQ,
    })
}
