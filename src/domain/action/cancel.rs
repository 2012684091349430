//! `cancel`: stop for good; the steps stay as they are (the default).

use super::Rules;

pub(super) struct Cancel;

impl Rules for Cancel {
    fn noun(&self) -> &'static str {
        "a cancel"
    }
}
